"""Uptraining: a trained softmax Transformer turned into a fast-weight one, then finetuned briefly
(``python -m fairseq_fwp.uptrain``; docs/uptraining.md).

- cli.py: the command's arguments, and what it runs;
- conversion.py: a softmax checkpoint converted into the fast-weight model a fairseq-train command builds;
- differences.py: the options by which two models would compute differently, which a conversion refuses;
- attention_transfer.py: the converted attentions trained on the softmax ones they replace;
- published_archives.py: where a published fairseq model comes from (``--pretrained``): fairseq's hub, a URL, an
  archive or a folder;
- published_model.py: what a published checkpoint is, the fairseq-train flags of its fast-weight twin, and
  the whole ``--pretrained`` conversion into a model folder;
- finetuning.py: the fairseq-train command that finetunes such a folder.
"""
