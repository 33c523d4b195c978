"""The Core AI runtime on macOS 27 and its fake, with specialization, load and predict timing."""
