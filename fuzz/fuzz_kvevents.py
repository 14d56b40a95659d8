"""Coverage-guided fuzzing of the KV-event decoder (atheris).

.venv/bin/python fuzz/fuzz_kvevents.py -runs=200000 -max_len=16384
"""

import sys

import atheris

with atheris.instrument_imports(include=["extproc", "harness"]):
    from harness import check_kv_events


def test_one_input(data: bytes) -> None:
    """atheris entry point."""
    check_kv_events(data)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
