"""deploy/mesh.py's Mesh.start: a mesh that cannot start leaves no process behind (its replicas
run in sessions of their own, so nothing else would reap them)."""

from __future__ import annotations

import pytest

from deploy.mesh import Mesh


def test_a_mesh_whose_replica_cannot_start_stops_the_others(tmp_path):
    mesh = Mesh(2, "", tmp_path / "mesh", router="smg", workers="grpc")  # the embedded model: r1 starts
    mesh.replicas[0].model = str(tmp_path / "no-such-model.gguf")  # r0 exits at once
    with pytest.raises(RuntimeError, match="replica r0 did not start"):
        mesh.start()
    assert all(r.proc is not None for r in mesh.replicas)  # both were launched
    assert not any(r.alive for r in mesh.replicas)  # and r1, loading or serving, was stopped
    assert mesh.smg.proc is None  # the router never started
