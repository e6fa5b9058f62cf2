"""servekeeper: run Ray Serve services and change them without dropping a request."""

__version__ = "0.1.0"
