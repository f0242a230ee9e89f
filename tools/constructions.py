"""The construction test's whole product (tests/test_constructions.py, issue 43): every module a user can build from
its factors, compared with its float64 composition. A developer's check, not run by CI (the test runs a sample).

    python tools/constructions.py [--all] [--jobs N] [--verbose]

Without --all it runs the test's sample. Prints the counts per conversion (ran, matched, named: a warning named the
module and its numbers match, raised: an error, silent: a wrong number with no warning, wrong_named: a wrong number
despite a warning), then every wrong number and unexpected error with its case; the wrong numbers of today's code
(KNOWN) are marked with why, and a case KNOWN names that computes right is listed as xpass. Exits 1 on any of
these, known ones included.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_constructions as T  # noqa: E402

OUTCOMES = ("matched", "named", "raised", "silent", "wrong_named")


_CASES: list = []  # the cases, set before forking: the workers read them by index


def _work(ks):
    return [(k, T.run(_CASES[k])) for k in ks]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--all", action="store_true", help="the whole product (default: the test's sample)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--verbose", action="store_true", help="list the errors expected by KNOWN_ERRORS too")
    args = ap.parse_args()
    cases = T.product()
    if not args.all:
        cases = T.sample()
    t0 = time.perf_counter()
    T.run(cases[0])  # before forking: torch.func's first call imports torch._dynamo (seconds)
    _CASES[:] = cases
    results: dict = {}
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for part in pool.imap_unordered(_work, [range(k, min(k + 200, len(cases))) for k in range(0, len(cases), 200)]):
            results.update(part)
            print(f"{len(results)}/{len(cases)} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    counts = collections.defaultdict(collections.Counter)
    bad = []
    for k, c in enumerate(cases):
        r = results[k]
        for key in (c.conversion, "all"):
            counts[key][r.outcome] += 1
        expected_error = r.outcome == "raised" and T.known(c, T.KNOWN_ERRORS)
        if r.outcome in ("silent", "wrong_named") or (r.outcome == "raised" and not expected_error):
            bad.append((c, r))
        elif T.known(c):  # the test's strict xfail would fail: the fix is in, or the predicate too wide
            bad.append((c, r._replace(outcome="xpass")))
        elif expected_error and args.verbose:
            print(f"raised (expected: {expected_error}): {c.id}: {r.detail}")
    print(f"{len(cases)} cases in {time.perf_counter() - t0:.0f} s ({args.jobs} jobs)\n")
    print(f"{'conversion':<12} {'ran':>6} " + " ".join(f"{o:>11}" for o in OUTCOMES))
    for key in [*T.FACTORS["conversion"], "all"]:
        n = counts[key]
        print(f"{key:<12} {sum(n.values()):>6} " + " ".join(f"{n[o]:>11}" for o in OUTCOMES))
    for c, r in bad:
        why = T.known(c)
        print(f"{r.outcome}: {c.id}: error {r.err:.3g} ({r.detail})" + (f" [known: {why}]" if why else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
