"""The load of bench/mesh.py, as a locust gRPC user: each user is a chat session, opened with a
client-chosen id that every call of it also sends as x-session-id metadata, a few streamed turns,
then closed. Time to first token ("TTFT") and whole turns ("turn") are reported as their own
entries, so their percentiles come out of locust's stats. Run by bench/mesh.py:

    locust -f bench/mesh_locustfile.py --headless -u 8 -r 8 -t 20s -H 127.0.0.1:8080 --csv out
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, task

grpc_gevent.init_gevent()  # locust runs users on gevent; grpc must cooperate with it

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgen.client import SESSION_HEADER, request  # noqa: E402
from kvgen.v1 import generate_pb2 as pb  # noqa: E402
from kvgen.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

TURNS_PER_SESSION = int(os.environ.get("MESH_TURNS", "4"))
MAX_NEW_TOKENS = int(os.environ.get("MESH_MAX_NEW_TOKENS", "32"))
QUESTIONS = ["Tell me about the sea.", "Why is the sky blue?", "Name three rivers.", "What is a prime number?",
             "Say something kind.", "How do trains work?"]


class ChatUser(User):
    wait_time = constant(0.05)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.sid, self.turns = "", 0

    def on_stop(self) -> None:
        self.channel.close()

    def _report(self, name: str, t0: float, length: int = 0, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(request_type="grpc", name=name,
                                             response_time=(time.perf_counter() - t0) * 1000,
                                             response_length=length, exception=exc, context={})

    def _md(self) -> tuple[tuple[str, str]]:
        return ((SESSION_HEADER, self.sid),)

    @task
    def turn(self) -> None:
        if not self.sid:
            self.sid = uuid.uuid4().hex
            t0 = time.perf_counter()
            try:
                self.stub.CreateSession(pb.CreateSessionRequest(session_id=self.sid), metadata=self._md(), timeout=60)
                self._report("CreateSession", t0)
            except grpc.RpcError as e:
                self._report("CreateSession", t0, exc=e)
                self.sid = ""
                return
        q = [{"role": "user", "content": QUESTIONS[self.turns % len(QUESTIONS)]}]
        t0, tokens, first = time.perf_counter(), 0, True
        try:
            for m in self.stub.GenerateStream(request(q, session_id=self.sid, max_new_tokens=MAX_NEW_TOKENS,
                                                      ignore_eos=True, temperature=0.0),
                                              metadata=self._md(), timeout=120):
                if first:
                    self._report("TTFT", t0)
                    first = False
                tokens += len(m.token_ids)
            self._report("turn", t0, tokens)
        except grpc.RpcError as e:
            self._report("turn", t0, exc=e)
            self.sid = ""  # a lost session is opened again, as a client would
            return
        self.turns += 1
        if self.turns % TURNS_PER_SESSION == 0:
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.sid), metadata=self._md(), timeout=60)
            self.sid = ""
