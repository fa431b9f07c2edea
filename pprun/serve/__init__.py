"""Serving: ``pprun serve`` over gRPC (pprun.v1, KServe v2 / Triton, health, reflection) and the
OpenAI-compatible HTTP API (``serve.http_port``).

Nothing is imported here: the generated KServe messages (``_proto.inference``) define the same
protobuf symbols as ``tritonclient``'s, and a process may hold only one of them, so a client
process importing ``pprun.serve._proto.pprun`` must not pull the server in.
"""
