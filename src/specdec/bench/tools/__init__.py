"""`specdec bench --tools`: BFCL tool-calling problems and their parameter schemas as structured output, through each
system's /v1/chat/completions, judged by BFCL's rules, ours beside llama-server --jinja."""
