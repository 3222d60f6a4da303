"""Load tests a user runs against a live server: ``tandem bench`` (loadgen/) and ``tandem chaos`` (chaos/)."""
