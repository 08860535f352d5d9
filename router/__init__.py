"""OpenAI-compatible HTTP front end that pairs prefill and decode servers, and `pdserve up`."""
