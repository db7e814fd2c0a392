"""Repository tools (``make docs``): they work on this checkout and are not shipped in the wheel."""
