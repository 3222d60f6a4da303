"""Load tests a user runs against a live server: ``tandem bench`` (loadgen/: load generation and
trace replay, with a report) and ``tandem chaos`` (chaos/: client aborts, forced retraction and
worker kills, every completed text checked by an oracle, every worker checked for leaks).
See README.md beside this file."""
