"""A local server for agents and apps: parsed boxes over HTTP (`app`), the MCP tool (`mcp`), the web page
(`web/`), all over one thread that owns MLX (`worker`). Needs the extra: `pip install "mlx-locate[server]"`.

    mlx-locate-server --model demo            # or: python -m mlx_locate.server
    mlx-locate-mcp --model demo
"""
