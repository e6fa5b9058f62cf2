"""KubeRay compatibility: pure translations between KubeRay's `RayService` and servekeeper's spec
and status. No I/O here: callers read files, secrets and the installed Ray version, and pass them in."""
