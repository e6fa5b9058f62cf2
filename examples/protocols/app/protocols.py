"""One tiny Serve deployment that speaks every protocol the ingress carries.

- `GET /` answers the version;
- `/ws` is a WebSocket that echoes each text message prefixed with the version (`v1:hello`);
- `GET /stream?chunks=N&interval_s=S` is a server-sent-event stream: the first event at once,
  then one every `interval_s` seconds, like tokens from a model;
- gRPC `ray.serve.UserDefinedService/Method1` (the protos Ray ships, so no generated code here)
  answers `<version>:<name>`; the Serve config must list
  `ray.serve.generated.serve_pb2_grpc.add_UserDefinedServiceServicer_to_server` in
  `grpc_options.grpc_servicer_functions`.

HTTP goes through FastAPI (`@serve.ingress`), whose ASGI `__call__` takes every HTTP request, so
the gRPC method has a name of its own.
"""

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.generated import serve_pb2

api = FastAPI()


@serve.deployment
@serve.ingress(api)
class Protocols:
    def __init__(self, version: str) -> None:
        self.version = version

    @api.get("/", response_class=PlainTextResponse)
    def root(self) -> str:
        return self.version

    @api.websocket("/ws")
    async def echo(self, socket: WebSocket) -> None:
        await socket.accept()
        try:
            while True:
                text = await socket.receive_text()
                await socket.send_text(f"{self.version}:{text}")
        except WebSocketDisconnect:
            pass

    @api.get("/stream")
    def stream(self, chunks: int = 3, interval_s: float = 1.0) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            for index in range(chunks):
                if index:
                    await asyncio.sleep(interval_s)
                yield f"data: {self.version} token {index}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def Method1(self, request: serve_pb2.UserDefinedMessage) -> serve_pb2.UserDefinedResponse:  # the proto names it
        return serve_pb2.UserDefinedResponse(greeting=f"{self.version}:{request.name}")


def app(args: dict) -> serve.Application:
    return Protocols.options(ray_actor_options={"num_cpus": 0}).bind(str(args.get("version", "v1")))
