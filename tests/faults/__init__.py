"""Damaged traces and faulty runs, made on purpose: the generators and fault harnesses the tests use
and the fault benchmarks run at scale (issue 42: benchmarks/ holds measurements only).

One module per family:
- corruptions.py, byte_damage.py, size_lies.py, special_files.py: ways a shared trace gets damaged,
  each a `Corruption` that damages a copy of a (reference, candidate) pair in place;
- meta_rows.py: one tensor's metadata read and rewritten in either trace format, and a format-3 copy;
- pristine.py: the oracle that says whether a damaged pair is materially different;
- damage_runner.py: the base pair, the catalogue of cases, and each case answered in a forked child;
- rank_faults.py: a rank SIGKILLed in a TP 2 recording, and the checked trial;
- replay_faults.py: a replay job struck by a fault, and the checked trial;
- dashboard_sessions.py: `ttrace dashboard` served on the sample traces, and browser sessions on it.

A benchmark never imports these: it runs one as a child process (`python -m tests.faults.replay_faults
... --out FILE`, through benchmarks/harness.py) and reads the JSON it writes; nothing here imports a
benchmark either (tests/test_layout.py checks both directions).
"""
