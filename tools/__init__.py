"""Developer tools that generate or check the docs; not part of the installed package."""
