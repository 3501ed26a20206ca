"""Text parsers shared by live watchers and offline diagnosis: one module per format family."""
