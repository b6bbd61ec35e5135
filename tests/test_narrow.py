"""pipeline/cluster/narrow.py: retries, then probes that halve a failing shard down to its bad rows."""
from pipeline.data.plan import Shard
from pipeline.cluster.narrow import Retries, failures_tolerated


def drive(num_rows, bad, max_attempts=2, transient=0):
    """Run the retry bookkeeping for one shard against an oracle: a try fails when it holds a
    row of `bad` (a final try never sends its bad rows to the engine), or while `transient`
    failures are left. Returns (the final try, the given-up try or None, tries in order)."""
    retries = Retries(max_attempts)
    queue, seen = [retries.first(Shard(0, 0, num_rows, num_rows))], []
    while queue:
        t = queue.pop(0)
        seen.append(t)
        rows = set(range(*t.probe)) if t.probe else set(range(num_rows)) - {r for r, _ in t.bad_rows}
        if transient or rows & bad:
            transient = max(transient - 1, 0)
            follow = retries.failed(t, f"boom {t.attempt}")
            if follow is None:
                return None, t, seen
            queue = follow + queue
        else:
            follow = retries.passed(t)
            if t.probe is None:
                return t, None, seen
            queue += follow
    raise AssertionError("no try committed or gave up")


def test_worked_example_from_the_docstring():
    final, gave_up, seen = drive(6, {4})
    assert gave_up is None and final.attempt == 9 and final.final
    assert [t.probe for t in seen] == [None, None, (0, 3), (3, 6), (3, 4), (4, 6), (4, 5), (5, 6), None]
    assert [r for r, _ in final.bad_rows] == [4]
    assert "fails on its own (boom 7)" in final.bad_rows[0][1]


def test_a_transient_failure_is_only_retried():
    final, gave_up, seen = drive(8, set(), max_attempts=3, transient=2)
    assert final.attempt == 3 and final.probe is None and not final.bad_rows and not final.final


def test_several_bad_rows_are_all_found_and_nothing_else():
    final, _, seen = drive(37, {0, 17, 18, 36}, max_attempts=1)
    assert [r for r, _ in final.bad_rows] == [0, 17, 18, 36]
    probed = [t for t in seen if t.probe]
    assert len(probed) < 37                                # far fewer tries than one per row


def test_every_row_bad_gives_up_after_the_final_try():
    final, gave_up, _ = drive(4, {0, 1, 2, 3}, max_attempts=1)
    assert final is not None and len(final.bad_rows) == 4    # nothing left to fail: it commits
    _, gave_up, _ = drive(4, set(), max_attempts=1, transient=100)   # a shard that always fails
    assert gave_up is not None and gave_up.final              # ... is written as error rows


def test_a_one_row_shard_gives_up_after_its_attempts():
    _, gave_up, seen = drive(1, {0}, max_attempts=2)
    assert gave_up.attempt == 2 and len(seen) == 2


def test_failures_tolerated_covers_one_bad_row_per_actor():
    for n in (1, 2, 3, 256, 1000):
        _, _, seen = drive(n, {n - 1}, max_attempts=3)
        in_a_row = longest_failing_run(seen, {n - 1})
        assert in_a_row < failures_tolerated(1, 3, n)
    assert failures_tolerated(4, 3, 256) == 4 * failures_tolerated(1, 3, 256)


def longest_failing_run(seen, bad):
    run = best = 0
    for t in seen:
        rows = set(range(*t.probe)) if t.probe else (set() if t.final else bad)
        run = run + 1 if rows & bad else 0
        best = max(best, run)
    return best
