"""The torch backend of row moves: the reference copies (the oracle of every test) and the
host-side copies it runs on a CPU."""
