"""What prefill and decode workers share (worker/README.md)."""
