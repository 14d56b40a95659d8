"""Coverage-guided fuzzing of request understanding (atheris).

.venv/bin/python fuzz/fuzz_request.py -runs=200000 -max_len=65536
"""

import sys

import atheris

with atheris.instrument_imports(include=["extproc", "harness"]):
    from harness import check_features


def test_one_input(data: bytes) -> None:
    """atheris entry point."""
    check_features(data)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
