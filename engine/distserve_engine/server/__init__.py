"""The HTTP servers: the OpenAI API over the router, and each instance's internal API."""
