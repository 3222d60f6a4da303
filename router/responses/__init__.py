"""OpenAI's Responses API (``/v1/responses``): the request, the output items and their stream, the
store that chains turns by ``previous_response_id``, and the routes."""
