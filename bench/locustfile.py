"""The reference experiment's load: every request on a new connection, no think time."""

from locust import HttpUser, constant, task


class NewConnectionUser(HttpUser):
    wait_time = constant(0)

    @task
    def call(self) -> None:
        # `Connection: close` makes every request open a fresh TCP connection, like the
        # reference's load, so a cluster that stops accepting shows up as failures at once.
        self.client.get("/", headers={"Connection": "close"}, timeout=60)
