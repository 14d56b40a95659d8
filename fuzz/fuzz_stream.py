"""Coverage-guided fuzzing of the ext_proc stream handler (atheris): message sequences in any
order, with arbitrary headers and bodies, through one long-lived router whose bounds must hold.

    .venv/bin/python fuzz/fuzz_stream.py -runs=50000 -max_len=16384
"""

import sys

import atheris

with atheris.instrument_imports(include=["extproc", "harness"]):
    from harness import check_stream, new_router

ROUTER = new_router()


def test_one_input(data: bytes) -> None:
    """atheris entry point."""
    check_stream(ROUTER, data)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
