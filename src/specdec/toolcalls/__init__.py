"""Tool calling: the model family's tool-call syntax (formats), parsing the output into OpenAI tool calls (parse,
streamed too), and the grammar that makes a required call valid (grammar). Pure: no model, no server."""
