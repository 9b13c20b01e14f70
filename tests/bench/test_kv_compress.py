"""bench/kv_compress.py's 8k table merged run by run: a run of some rows (off always, the reference)
replaces those rows in the sidecar and keeps the others while its off equals theirs; the table is made
from the sidecar and spliced into kv.md in place of the old one, the rest of the file kept."""

from __future__ import annotations

from bench.kv_compress import (
    LONG_HEADING,
    LONG_ROWS,
    SAME_OFF,
    long_key,
    long_row,
    markdown_long,
    merge_long,
    splice_long,
)

SETTINGS = {"tokens": 8192, "first": 2200, "chunk": 64}


def _run(names: list[str], off_ppl: float = 2.3951, seconds: float = 100.0) -> dict:
    """A run_long result of `names` (off first, as run_long puts it), each row's perplexities its own."""
    rows = []
    for name in ["off", *(n for n in names if n != "off")]:
        method, ratio = long_row(name)
        ppl = off_ppl if name == "off" else off_ppl * (1 + 0.1 * (LONG_ROWS.index(name) + 1))
        rows.append({"method": method, "ratio": ratio, "ppl": ppl, "ppl_first": ppl + 20, "ppl_rest": ppl - 1.3,
                     "bpt": None, "s": seconds / len(names)})
    return {"rows": rows, **SETTINGS, "seconds": seconds}


def test_every_row_name_round_trips():
    for name in LONG_ROWS:
        method, ratio = long_row(name)
        assert long_key({"method": method, "ratio": ratio}) == name
    assert long_row("sink-heavy:0.25") == ("sink-heavy", 0.25) and long_row("q3") == ("q3", None)


def test_a_run_of_some_rows_replaces_those_and_keeps_the_rest():
    first, dropped = merge_long(None, _run([n for n in LONG_ROWS if n != "q3"], seconds=2982), "day 1")
    assert dropped == [] and list(first["rows"]) == [n for n in LONG_ROWS if n != "q3"]
    assert "Not measured at 8k: q3" in markdown_long(first)

    second, dropped = merge_long(first, _run(["off", "q3"], off_ppl=2.3951 + SAME_OFF / 2), "day 2")
    assert dropped == [] and list(second["rows"]) == LONG_ROWS  # the table's order, q3 last
    assert {n: r["run"] for n, r in second["rows"].items()} == {
        n: "day 2" if n in ("off", "q3") else "day 1" for n in LONG_ROWS}
    assert second["runs"] == {"day 1": first["runs"]["day 1"], "day 2": {"seconds": 100, "rows": ["off", "q3"]}}
    md = markdown_long(second)
    assert "Not measured" not in md and "Rows from 2 runs" in md
    lines = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0][2:] for line in lines] == [
        "off (fp32)", "mean 0.5", "sink-heavy 0.5", "sink-heavy 0.25", "fp8", "q4", "q3"]
    q3, off = second["rows"]["q3"], second["rows"]["off"]  # vs the new off
    assert f"| q3 | {q3['ppl']:.4f} | {q3['ppl'] / off['ppl'] - 1:+.2%} |" in md


def test_rows_measured_beside_another_off_or_setting_are_dropped():
    first, _ = merge_long(None, _run(["off", "fp8", "q4"]), "day 1")
    moved, dropped = merge_long(first, _run(["off", "q3"], off_ppl=2.3951 + 3 * SAME_OFF), "day 2")
    assert dropped == ["fp8", "q4"] and list(moved["rows"]) == ["off", "q3"] and list(moved["runs"]) == ["day 2"]
    other = {**_run(["off"]), "chunk": 128}
    _, dropped = merge_long(first, other, "day 2")
    assert dropped == ["fp8", "q4"]


def test_the_table_replaces_the_old_one_in_place():
    data, _ = merge_long(None, _run(LONG_ROWS), "day 1")
    sub = markdown_long(data)
    top = "# KV\n\n## Compressed KV (KV_COMPRESS)\n\ntext\n\n"
    later = "\n## Decode speed at 1k tokens of context\n\nits table\n"
    old = f"{top}{LONG_HEADING}\n\nold table\n\nq3 at 8k: not measured\n{later}"
    assert splice_long(old, sub) == f"{top}{sub}{later}"
