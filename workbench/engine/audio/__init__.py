"""Audio in: decoding files, bytes and arrays to 16 kHz PCM (`pcm`) and Whisper's log-mel
features (`mel`)."""
