"""OpenAI's Responses API (``/v1/responses``): the request (protocol.py), the output items and
their stream (output.py), the store that chains turns by ``previous_response_id`` (store.py),
and the routes (routes.py). Over the same FrontDoor and streaming as the chat routes."""
