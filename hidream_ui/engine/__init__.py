"""The engine: `engine` (EditEngine: lifecycle, lock, edit), `jobs` (cancel tokens), `batch`,
`compare`."""
