"""Commands beside the suite: the bug zoo's self-test, exploration, the golden corpus, benchmarks."""
