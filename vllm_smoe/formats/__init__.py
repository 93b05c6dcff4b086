"""The files smoe reads and writes, shared by serving and the offline tools (no torch, no vLLM).

- ``trace``: routing traces (``.npz``), their writer, readers and spill recovery (gathered from the
  ``trace_*`` modules beside it);
- ``placement_file``: the YAML placement and its predictor tables file;
- ``model_info``: which decoder layers of a Hugging Face config route to experts, and how many;
- ``checkpoint``: the input embedding read straight from a safetensors checkpoint (fp8 included);
- ``bounded``: readers that trust no file's claims about itself, and the output-kind check.
"""
