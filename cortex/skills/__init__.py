"""Skills: tools the persona may call while it replies (built-in, HTTP from config, MCP servers)."""
