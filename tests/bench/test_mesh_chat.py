"""bench/mesh_chat.py's pure parts: its section of bench/results/mesh.md replaced in place (the
other sections kept byte for byte), and the hit rate counted over the turns after the first."""

from __future__ import annotations

from bench.mesh_chat import HEADING, Turn, replace_section, summary

TOP = "# Mesh: 2 replicas behind Envoy vs 1 replica direct\n\nbench/mesh.py's table\n"
LATER = "## Another bench\n\nits text\n"


def test_the_section_is_appended_once_then_replaced_in_place():
    first = replace_section(TOP, HEADING, f"{HEADING}\n\nrun 1\n")
    assert first == f"{TOP}\n{HEADING}\n\nrun 1\n"
    assert replace_section(first, HEADING, f"{HEADING}\n\nrun 2\n") == f"{TOP}\n{HEADING}\n\nrun 2\n"
    middle = f"{TOP}\n{HEADING}\n\nrun 1\n\n{LATER}"
    assert replace_section(middle, HEADING, f"{HEADING}\n\nrun 2\n") == f"{TOP}\n{HEADING}\n\nrun 2\n\n{LATER}"
    assert replace_section("", HEADING, f"{HEADING}\n\nrun 1\n") == f"{HEADING}\n\nrun 1\n"


def _turn(client: int, turn: int, cached: int, seconds: float = 1.0) -> Turn:
    return Turn(client, turn, seconds, prompt_tokens=100, cached_tokens=cached, completion_tokens=32, text="")


def test_the_hit_rate_counts_the_turns_after_the_first_only():
    # client 0 kept its prefix on turn 1 and lost it on turn 2; first turns never count
    turns = [_turn(0, 0, 0), _turn(0, 1, 64), _turn(0, 2, 0), _turn(1, 0, 0), _turn(1, 1, 48, seconds=3.0)]
    r0 = {"kvgen_prefix_cache_hit_tokens_total": 120.0, "kvgen_requests_finished_total": 3.0, "cpu s": 4.0}
    r1 = {**r0, "kvgen_requests_finished_total": 2.0, "cpu s": 2.5}
    s = summary([{"wall": 7.5, "turns": turns, "replicas": {"r0": r0, "r1": r1}}])
    assert s["cached %"] == 100 * 2 / 3
    assert s["cached tokens"] == 112 and s["hit tokens"] == 240 and s["prompt tokens"] == 500
    assert s["calls"] == {"r0": 3.0, "r1": 2.0} and s["walls"] == [7.5] and s["cpu"] == [6.5]
    assert s["p50"] == 1.0 and s["p95"] == 3.0 and s["mean"] == 7 / 5
