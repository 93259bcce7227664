"""The picklable vocabulary of a case: its id, configuration, layout, records, phases and verdict."""
