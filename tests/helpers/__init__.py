"""What the tests share, imported as ``tests.helpers.<module>`` (never from another test module):

- configs: every transformers config the suite builds (tiny defaults, a test names what it changes); the only
  place one is written
- models, native_models: model builders (Hugging Face decoders at toy sizes, hand-written PyTorch models)
- architectures, moe, training: what several test files build and check (the nine architectures of
  configs.ARCHITECTURES, the MoE models, the one-process training the pipeline tests compare with)
- exact: TOL, the suite's one tolerance, and the checks that a sharded model computes what the model computes
- sequence_parallel, activations: the exactness check with tokens split, the activation bytes autograd keeps
- distributed: spawning ranks (run_ranks), counting collectives; shared_capture: one capture per test

tests/test_helpers.py checks the rules: configs only in configs.py, TOL only in exact.py, no test module imported,
no edits to sys.path."""
