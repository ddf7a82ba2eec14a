"""The registry: the names a run may use and the objects they stand for, no jax until a row is
used: the parallel strategies and the rules joining them to the other options (strategies.py);
the model families (families.py); a model under a strategy on a mesh, what the rows build
(program.py); the attention settings' choices (attention_choices.py); the parameter dtypes
(dtypes.py); what a non-finite loss does, the step's and the run's one vocabulary
(nonfinite.py); a row's reference to what needs jax, imported when read (lazy.py)."""
