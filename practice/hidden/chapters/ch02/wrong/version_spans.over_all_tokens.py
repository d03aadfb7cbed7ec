# Counts positions over prompt plus output instead of over the output tokens.
spans: list[dict] = []
for i, v in enumerate(self.token_versions, start=self.num_prompt_tokens):
    if spans and spans[-1]["version"] == v:
        spans[-1]["end"] = i + 1
    else:
        spans.append({"version": v, "start": i, "end": i + 1})
return spans
