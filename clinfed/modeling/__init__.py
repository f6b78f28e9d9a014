"""Models and their training: encoders with a task's head, one file per
model family (``families/``), parameter blocks, the plans that train part
of a model (LoRA, bias terms, the head), pFedDC's prompts, the gazetteer's
marks and THE training loop. Imports no task, no federation, no runner."""
