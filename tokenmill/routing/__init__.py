"""Model routing's learned part: prompt features and a small classifier trained from logged outcomes."""
