// The mlx-locate page: pick or drop an image, ask /v1/locate with "stream": true, draw each box or point as
// its server-sent event arrives. The overlay's viewBox is the image's own pixel frame, so the API's pixel
// coordinates are drawn as they are.
"use strict";

const $ = (id) => document.getElementById(id);
const COLORS = ["#e6194b", "#2f6fde", "#1b9e3e", "#f58231", "#911eb4", "#008080", "#9a6324", "#f032e6"];
const SVG = "http://www.w3.org/2000/svg";
let imageData = null; // the picked image as a data URL

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

function showImage(dataUrl) {
  imageData = dataUrl;
  $("image").src = dataUrl;
  $("frame").hidden = false;
  $("hint").hidden = true;
  $("run").disabled = false;
  clearResults();
}

// Show the image as large as the stage allows (small images scale up, large ones down); the overlay follows.
function fitImage() {
  const img = $("image");
  if (!img.naturalWidth) return;
  const stage = $("drop").clientWidth - 24;
  const scale = Math.min(stage / img.naturalWidth, (0.72 * window.innerHeight) / img.naturalHeight);
  img.style.width = `${Math.floor(img.naturalWidth * scale)}px`;
}

function readFile(file) {
  const reader = new FileReader();
  reader.onload = () => showImage(reader.result);
  reader.readAsDataURL(file);
}

function clearResults() {
  $("overlay").replaceChildren();
  $("objects").tBodies[0].replaceChildren();
  $("json").textContent = "";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function svgElement(name, attrs) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function draw(obj, color, width) {
  const overlay = $("overlay");
  const label = obj.label ?? obj.query ?? "";
  const size = Math.max(10, width / 28);
  let x, y;
  if (obj.box) {
    const [x1, y1, x2, y2] = obj.box;
    overlay.append(svgElement("rect", {
      class: "box", x: x1, y: y1, width: x2 - x1, height: y2 - y1, stroke: color, "data-box": obj.box.join(","),
    }));
    [x, y] = [x1 + 2, y1 > size ? y1 - size / 4 : y1 + size];
  } else {
    const [px, py] = obj.point;
    overlay.append(svgElement("circle", {
      class: "point", cx: px, cy: py, r: Math.max(3, width / 90), fill: color, "data-point": obj.point.join(","),
    }));
    [x, y] = [px + width / 60, py - width / 80];
  }
  const conf = obj.confidence == null ? "" : ` ${obj.confidence.toFixed(2)}`;
  const text = svgElement("text", { x, y, fill: color, "font-size": size });
  text.textContent = `${label}${conf}`;
  overlay.append(text);
}

function addRow(obj, color, seconds) {
  const row = $("objects").tBodies[0].insertRow();
  const where = (obj.box ?? obj.point).map((v) => Math.round(v)).join(", ");
  const cells = [
    `<span class="swatch" style="background:${color}"></span>`,
    obj.label ?? obj.query ?? "-",
    obj.box ? `[${where}]` : `(${where})`,
    obj.confidence == null ? "" : obj.confidence.toFixed(3),
    seconds.toFixed(2),
  ];
  for (const c of cells) row.insertCell().innerHTML = c;
  for (const i of [1, 2]) row.cells[i].textContent = cells[i]; // labels are model text: never HTML
}

async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      let data = "";
      for (const line of frame.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      yield { event, data: JSON.parse(data) };
    }
  }
}

async function locate(event) {
  event.preventDefault();
  const queries = $("queries").value.split("\n").map((q) => q.trim()).filter(Boolean);
  const task = $("task").value;
  const body = { image: imageData, task, mode: $("mode").value, stream: true };
  if (task === "raw") body.query = queries.join("\n");
  else if (task !== "ocr") body.query = queries.length > 1 ? queries : queries[0];
  clearResults();
  $("run").disabled = true;
  setStatus("queued...");
  const t0 = performance.now();
  let width = $("image").naturalWidth;
  let count = 0;
  try {
    const response = await fetch("/v1/locate", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!response.ok) {
      const err = await response.json().catch(() => ({ error: { message: response.statusText } }));
      throw new Error(`${response.status}: ${err.error.message}`);
    }
    for await (const { event: kind, data } of serverEvents(response)) {
      const seconds = (performance.now() - t0) / 1000;
      if (kind === "start") {
        width = data.image.width;
        $("overlay").setAttribute("viewBox", `0 0 ${data.image.width} ${data.image.height}`);
        setStatus("decoding...");
      } else if (kind === "object") {
        const color = COLORS[data.query_index % COLORS.length];
        draw(data, color, width);
        addRow(data, color, seconds);
        count += 1;
        setStatus(`${count} found so far (${seconds.toFixed(2)} s)`);
      } else if (kind === "empty") {
        const row = $("objects").tBodies[0].insertRow();
        row.insertCell();
        row.insertCell().textContent = data.label ?? data.query;
        row.insertCell().textContent = "not found";
        row.cells[2].colSpan = 3;
      } else if (kind === "done") {
        const results = data.queries ?? [data];
        const s = results[0].stats;
        const firstBox = s.first_box_s == null ? "-" : `${s.first_box_s.toFixed(2)} s`;
        const steps = results.reduce((n, r) => n + r.stats.steps, 0);
        setStatus(`${count} found in ${seconds.toFixed(2)} s; server: first box ${firstBox}, ` +
          `vision ${s.vision_s.toFixed(2)} s, ${steps} forward passes`);
        $("json").textContent = JSON.stringify(data, null, 2);
      } else if (kind === "error") {
        throw new Error(data.error.message);
      }
    }
  } catch (err) {
    setStatus(err.message, true);
  } finally {
    $("run").disabled = false;
  }
}

$("file").addEventListener("change", (e) => e.target.files[0] && readFile(e.target.files[0]));
$("drop").addEventListener("dragover", (e) => { e.preventDefault(); $("drop").classList.add("over"); });
$("drop").addEventListener("dragleave", () => $("drop").classList.remove("over"));
$("drop").addEventListener("drop", (e) => {
  e.preventDefault();
  $("drop").classList.remove("over");
  if (e.dataTransfer.files[0]) readFile(e.dataTransfer.files[0]);
});
$("example").addEventListener("click", async (e) => {
  e.preventDefault();
  const blob = await (await fetch("/example.png")).blob();
  readFile(blob);
});
$("controls").addEventListener("submit", locate);
$("image").addEventListener("load", fitImage);
window.addEventListener("resize", fitImage);
fetch("/health").then((r) => r.json()).then((h) => { $("model").textContent = `model: ${h.model}`; })
  .catch(() => { $("model").textContent = "server unreachable"; });
