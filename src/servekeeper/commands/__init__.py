"""Domain commands shared by the API, the dashboard and anything else: apply a spec, roll out,
undo, manage host pools. They raise `commands.errors` (never an HTTP status); each transport maps
those once."""
