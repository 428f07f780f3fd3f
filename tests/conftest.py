"""Shared pytest setup: tests/ on sys.path so helper modules (model_factory) import plainly."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
