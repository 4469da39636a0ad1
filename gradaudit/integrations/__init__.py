"""gradaudit inside the trainers people fine-tune with: callbacks for Hugging Face's ``transformers.Trainer``
(``gradaudit.integrations.transformers``) and ``lightning.pytorch.Trainer`` (``gradaudit.integrations.lightning``).

Each callback audits the first batch of the trainer's own training data, writes the HTML and JSON report,
logs the held and reclaimable bytes through the trainer's logging, and puts ``gradaudit.trim`` and/or a
checkpointing plan on the model for the run. What both share, without any trainer, is in ``session.py``.

Importing this package imports neither trainer library: each lives in its own module, imported by the user.
"""
