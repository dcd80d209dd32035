//! The worker fleet (in progress).
