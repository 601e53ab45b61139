"""The injection plan and its rendering, pure: plan once, render the Server-Side Apply bodies, tell drift."""
