"""Backends written for the tests, apart from the lab's fake replica: they behave as ours never do."""
