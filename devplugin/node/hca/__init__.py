"""The HCA wing's node side: how HCAs are judged and served."""
