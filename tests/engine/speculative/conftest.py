import pytest

from kvgen.engine.speculative import DraftEconomy


@pytest.fixture
def gate_open(monkeypatch):
    """The engine's cost gate held open: for tests of something else whose drafter costs about
    what it saves (a self-draft, a head over a 2-layer target), where timing would decide it."""
    monkeypatch.setattr(DraftEconomy, "pays", lambda self, drafted, kept, sequences: True)
