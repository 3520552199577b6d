"""`erniekit-lite webui`: a browser UI over the same recipes and commands (train, validate, chat, merge, push).

One module per job: `paths` confines what users type to the start directory, `forms` maps form fields to and
from a recipe, `jobs` runs `erniekit-lite train` as a subprocess and `progress` reads its `progress.jsonl`,
`preview` renders tokenized records, and one `*_tab` module per tab wires them into Gradio (`app` assembles them).
"""
