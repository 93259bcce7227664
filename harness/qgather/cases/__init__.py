"""The case suite's definitions: one module per module of cases/ (a checkout's thin test modules
import from here), so that an installed qgather carries the whole suite.

`qgather run` collects cases/ in a checkout and this package in an install (the case ids are the
same); `python -m pytest --pyargs qgather.cases` runs it from any directory.
"""
