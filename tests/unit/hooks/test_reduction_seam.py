"""A whole-gradient-reduction seam that meets a layout it cannot read stops following it: its
state is marked failed (its hooks then do nothing) and one line names the rank and the cause."""

from __future__ import annotations

import logging

from msmon.seams.reduction_seam import stop_following


def test_a_seam_that_cannot_read_its_framework_stops_and_says_why(caplog):
    logging.getLogger("msmon").propagate = True
    state = {"failed": False, "reducing": True}
    with caplog.at_level(logging.WARNING, logger="msmon"):
        stop_following(state, "read FSDP's flat gradient", AttributeError("no _numels"))
    assert state == {"failed": True, "reducing": True}
    assert [r.getMessage() for r in caplog.records] == [
        "msmon[rank 0]: cannot read FSDP's flat gradient (AttributeError('no _numels')); grad_agreement is not "
        "recorded from now on (said once)"
    ]
