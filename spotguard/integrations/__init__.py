"""spotguard inside the training frameworks people use instead of a loop.

- :mod:`spotguard.integrations.huggingface`: a ``TrainerCallback`` for
  ``transformers.Trainer`` (``pip install spotguard[hf]``);
- :mod:`spotguard.integrations.lightning`: a ``Callback`` for PyTorch
  Lightning (``pip install spotguard[lightning]``).

Both let the framework write its own checkpoints and commit each as a
spotguard checkpoint (:meth:`spotguard.Checkpointer.commit_folder`), turn
spotguard's save-now and preemption requests into the framework's own save
and stop, and hand the newest verified checkpoint back on resume
(:meth:`spotguard.Checkpointer.resume_folder`). Importing this package
imports no framework.
"""
