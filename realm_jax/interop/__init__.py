"""Foreign formats in and out: what other toolkits wrote, read without them, and what they load.

Readers and writers (below data/ and model/: they hold bytes and arrays, never our model or
corpus, so data/, model/ and train/ may call them):
  protowire           Protocol Buffers' wire format (varints, fields), without protobuf
  tfrecord            TFRecord framing (crc32c-checked; .gz too), read and written
  tf_checkpoint       TF1 checkpoints (tensor bundles), without TensorFlow
  release_checkpoint  the REALM/ORQA release's checkpoints and TF-Hub modules -> HF tensor names
  safe_pickle         torch's pytorch_model.bin, unpickled by an allow-list (no torch)
  hf_import           HuggingFace REALM/BERT folders -> realm-jax params, checked against config
  hf_export           realm-jax params -> HuggingFace REALM folders (safetensors)
  block_records       the release's block corpus: ORQA's blocks.tfr + titles.tfr, HF's
                      block_records.npy (the blocks made of them: data/release_blocks.py)
  realm_records       REALM's annotated pre-training shards (tf.train.Example, salient spans)

The command (an entry point, above every other room; cli.py names it as a string):
  commands            `realm-jax import` and `realm-jax export`: workdirs from and to the above
"""
